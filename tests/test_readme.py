"""README.md is a user's manual: its first screen has the two commands, the headline table and the model's use;
its links lead somewhere; measurements with their machines live in benchmarks/RESULTS.md, not here (issue 29)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FIRST_SCREEN = 80  # lines


def readme() -> str:
    return README.read_text(encoding="utf-8")


def without_code(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (where `[x](y)` is code, not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


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


def test_every_relative_link_points_to_a_file_or_heading_that_exists():
    text = readme()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", without_code(text), flags=re.M)}
    links = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", without_code(text))
    assert links, "README links to benchmarks/RESULTS.md at least"
    for target in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        if path:
            assert (README.parent / path).exists(), f"README links to {target}, which does not exist"
        elif fragment:
            assert fragment in anchors, f"README links to #{fragment}, no such heading"
    assert "benchmarks/RESULTS.md" in links


def test_no_lab_notebook_in_readme():
    assert "load average" not in readme().lower()
