"""`lex export MODEL_DIR OUT_DIR [--push_to_hub REPO_ID [--private] [--dry_run]]`: a Hub-ready folder (lex.export)."""

from pathlib import Path

import lex.export
from lex.commands import LexArgumentParser
from lex.export import export, push_to_hub


def build_parser() -> LexArgumentParser:
    parser = LexArgumentParser("export", description=lex.export.__doc__)
    parser.add_argument("model_dir", type=Path, help="a LEX model folder (save_pretrained, lex train, lex demo)")
    parser.add_argument("out_dir", type=Path, help="the folder to write; refused if it exists, unless --force")
    parser.add_argument("--push_to_hub", metavar="REPO_ID", help="upload the folder to this Hub model repository")
    parser.add_argument("--private", action="store_true",
                        help="create the Hub repository as private (an existing one keeps its visibility)")
    parser.add_argument("--dry_run", action="store_true", help="print what --push_to_hub would commit; no network")
    parser.add_argument("--results", type=Path,
                        help="results.json of `lex eval-length` for the card's table (default: MODEL_DIR's own)")
    parser.add_argument("--license", help="Hub license id for the card (default: that of MODEL_DIR's card, else mit)")
    parser.add_argument("--max_shard_size", default="2GB", help="shard model.safetensors above this (default 2GB)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.private or args.dry_run) and not args.push_to_hub:
        used = [parser.flag(dest) for dest in ("private", "dry_run") if getattr(args, dest)]
        parser.error(f"{' and '.join(used)} go with {parser.flag('push_to_hub')} REPO_ID")
    folder = export(args.model_dir, args.out_dir, results=args.results, license_name=args.license,
                    max_shard_size=args.max_shard_size, repo_name=args.push_to_hub, force=args.force)
    print(f"exported {folder}")
    if args.push_to_hub:
        print(push_to_hub(folder, args.push_to_hub, private=args.private, dry_run=args.dry_run))
    return 0
