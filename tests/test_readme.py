"""README.md is the entry: its first screen has the two commands, the headline table and the model's use; its links
lead somewhere; measurements with their machines live on docs/results.md, not here (issues 29 and 67). Every command
printed in README.md and docs/ is in step with the parsers: each `lex COMMAND --flag` of a fenced bash block names a
flag COMMAND's parser shows (the values and combinations parse as written: tests/test_cli.py), each `python
benchmarks/NAME.py --flag` a script and a flag it defines; and each bash block runs as printed in a test (a `<!--
runs: tests/FILE.py::TEST -->` comment before it, that test reading the block from the page) or says what it needs
(`<!-- needs: gpu -->`, `hours`, `minutes`, `your-files`, `network`)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FIRST_SCREEN = 80  # lines
NEEDS = {"gpu", "hours", "minutes", "your-files", "network"}  # what a block that no test runs may need
CONVERT_GUIDE = DOCS / "guides" / "convert.md"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def pages() -> list[Path]:
    """README.md and every page of the documentation site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def without_code(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (where `[x](y)` is code, not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def code_blocks(path: Path, language: str = "bash") -> list[tuple[int, str, list[str]]]:
    """The fenced blocks of `language` in a page: (line of the fence, the block's text, the HTML comments on the
    lines right before the fence, innermost last)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            comments, k = [], i - 1
            while k >= 0 and re.fullmatch(r"<!--.*-->", lines[k].strip()):
                comments.insert(0, lines[k].strip()[4:-3].strip())
                k -= 1
            if lines[i][3:].strip() == language:
                blocks.append((i + 1, "\n".join(lines[i + 1 : end]) + "\n", comments))
            i = end
        i += 1
    return blocks


def marked_blocks(path: Path, test: str, language: str = "bash") -> list[str]:
    """The blocks of a page that a `<!-- runs: TEST -->` comment says the test `test` (FILE.py::NAME) runs."""
    return [text for _, text, comments in code_blocks(path, language) if f"runs: {test}" in comments]


def commands(block: str) -> list[list[str]]:
    """The shell commands of a block, continuation lines joined, comments dropped, split at && || ; |."""
    found = []
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        words, command = shlex.split(line, comments=True), []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                found += [command] if command else []
                command = []
            else:
                command.append(word)
    return found


def lex_commands(page: Path) -> list[list[str]]:
    """Each `lex ...` (or `.venv/bin/lex`, `-m lex.cli`) command of a page's bash blocks, as the words after `lex`."""
    lines = []
    for _, block, _ in code_blocks(page):
        for words in commands(block):
            for i, word in enumerate(words):
                if word == "lex" or word.endswith("/bin/lex") or (word == "lex.cli" and words[i - 1] == "-m"):
                    lines.append(words[i + 1 :])
                    break
    return lines


def test_the_first_screen_has_the_two_commands_the_headline_table_and_the_models_use():
    first = "\n".join(readme().splitlines()[:FIRST_SCREEN])
    assert re.search(r"pip install -q -e \. && \.venv/bin/lex demo$", first, flags=re.M), "the lex demo install"
    assert "<!-- test-command -->" in first and "<!-- /test-command -->" in first, "the test command block"
    block = first.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    assert "python -m pytest -q" in block and "-m oldest" in block
    for model in ("xpos", "rope", "alibi"):
        assert re.search(rf"^\| {model} \| full \|( [0-9.]+ \|)+$", first, flags=re.M), f"Table 2's {model} row"
    assert "`lex demo`" in first, "the headline table names the command that makes it"
    assert "from_pretrained" in first or "from_config" in first


def test_readme_is_an_entry_not_a_manual():
    text = readme()
    assert len(text.splitlines()) <= 250, "README.md is the entry; the manual is docs/"
    assert "Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 and Gemma 3" in text, "the eight families"
    for page in pages():
        stale = re.findall(r"Llama(?:/|, )Mistral(?:/| (?:and|or) )Qwen2\b", page.read_text(encoding="utf-8"))
        assert not stale, f"{page.relative_to(ROOT)} names three families where eight convert"


def test_every_relative_link_points_to_a_file_or_heading_that_exists():
    text = readme()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", without_code(text), flags=re.M)}
    links = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", without_code(text))
    assert links, "README links to docs/results.md at least"
    for target in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        if path:
            assert (README.parent / path).exists(), f"README links to {target}, which does not exist"
            if fragment and path.endswith(".md"):
                page = re.sub(r"^```.*?^```", "", (README.parent / path).read_text(encoding="utf-8"), flags=re.S | re.M)
                headings = {github_anchor(h.replace("`", "")) for h in re.findall(r"^#+ (.+)$", page, flags=re.M)}
                assert fragment in headings, f"README links to {target}: no such heading"
        elif fragment:
            assert fragment in anchors, f"README links to #{fragment}, no such heading"
    assert "docs/results.md" in links
    linked = {target.partition("#")[0] for target in links}
    for page in sorted(DOCS.rglob("*.md")):  # every page of the site is reachable from the entry
        assert str(page.relative_to(ROOT)) in linked, f"README does not link to {page.relative_to(ROOT)}"


def test_no_lab_notebook_in_readme_or_docs():
    for page in pages():
        assert "load average" not in page.read_text(encoding="utf-8").lower(), page.relative_to(ROOT)
    assert not (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").count("\n|"), "a pointer, no tables"


def test_every_bash_block_runs_in_a_test_or_says_what_it_needs():
    """A `runs:` comment names a test that exists and reads the page it runs the block from (or .ci/run, for the
    test command); a `needs:` comment names only what NEEDS lists."""
    unmarked = []
    for page in pages():
        name = str(page.relative_to(ROOT))
        for line, block, comments in code_blocks(page):
            runs = [c.split(":", 1)[1].strip() for c in comments if c.startswith("runs:")]
            needs = [c.split(":", 1)[1] for c in comments if c.startswith("needs:")]
            if not runs and not needs:
                unmarked.append(f"{name}:{line}")
            for want in needs:
                assert {w.strip() for w in want.split(",")} <= NEEDS, f"{name}:{line}: needs {want}"
            for test in runs:
                if test == ".ci/run":
                    assert "test-command" in comments and (ROOT / ".ci" / "run").exists(), f"{name}:{line}"
                    continue
                file, _, function = test.partition("::")
                source = (ROOT / file).read_text(encoding="utf-8")
                assert re.search(rf"^def {re.escape(function)}\(", source, flags=re.M), f"{name}:{line}: no {test}"
                assert f'"{page.name}"' in source or name in source, f"{test} does not read {name}"
    assert not unmarked, f"bash blocks that no test runs and that say nothing of what they need: {unmarked}"


def test_every_flag_of_a_lex_command_in_readme_and_docs_is_one_its_parser_shows():
    """Flag names only, cheaply (tests/test_cli.py parses the same command lines with their values): the spelling
    --help shows, so that a renamed or removed flag fails here, naming the page."""
    from tests.test_cli import parsers

    tables = parsers()
    shown = {name: {o for a in parser._actions for o in a.option_strings} for name, parser in tables.items()}
    seen = set()
    for page in pages():
        for name, *args in lex_commands(page):
            assert name in tables, f"{page.relative_to(ROOT)}: `lex {name}` is no command"
            seen.add(name)
            for arg in args:
                flag = arg.split("=", 1)[0]
                if flag.startswith("--"):
                    assert flag in shown[name], f"{page.relative_to(ROOT)}: `lex {name} {flag}`: no such flag"
    assert seen == set(tables), f"commands no page shows: {set(tables) - seen}"


def test_every_benchmark_command_names_a_script_and_its_flags():
    for page in pages():
        for _, block, _ in code_blocks(page):
            for words in commands(block):
                scripts = [w for w in words if re.fullmatch(r"(benchmarks/)?\w+\.py", w) and "python" in words[0]]
                if not scripts:
                    continue
                path = ROOT / "benchmarks" / Path(scripts[0]).name
                assert path.exists(), f"{page.relative_to(ROOT)}: {scripts[0]} does not exist"
                source = path.read_text(encoding="utf-8")
                for flag in (w.split("=", 1)[0] for w in words if w.startswith("--")):
                    assert f'"{flag}"' in source, f"{page.relative_to(ROOT)}: {path.name} has no {flag}"


def lex_environment(bin_dir: Path) -> dict:
    """The environment a user's shell has in the venv whose scripts are in bin_dir."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(bin_dir.parent),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_the_conversion_guide_runs_as_printed(tmp_path):
    """docs/guides/convert.md's first two blocks, in an empty folder: a random Llama saved as my-llama, converted
    to LEX in full attention and blockwise, and back."""
    blocks = marked_blocks(CONVERT_GUIDE, "tests/test_readme.py::test_the_conversion_guide_runs_as_printed")
    assert len(blocks) == 2
    env = lex_environment(Path(sys.executable).parent)
    for block in blocks:
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
    for folder in ("my-llama", "my-llama-lex", "my-llama-bca", "my-llama-again"):
        assert (tmp_path / folder / "config.json").exists(), folder
    assert '"model_type": "llama"' in (tmp_path / "my-llama-again" / "config.json").read_text()
    assert '"attention_mode": "blockwise"' in (tmp_path / "my-llama-bca" / "config.json").read_text()
