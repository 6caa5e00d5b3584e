"""The docs' maps of anneal/ name what is in the tree, so that they cannot drift from it.

docs/architecture.md, "What each part holds": one bullet per package of anneal/, opening with
the package's name in backticks (`` `train/` ``); in it, every module of the package is named
in backticks by its bare name (`` `trainer` ``; ``__init__`` and ``__main__`` may be left
out), and every bare lowercase name in backticks is a module of that package (other things
go in backticks with what makes them not a bare name: `` `RUN/evals/step-<N>.json` ``,
`` `deepspeed.initialize` ``, `` `Launch` ``, `` `anneal eval` ``). Each module directly under
anneal/ is named there as `` `name.py` ``. README.md, the "Layout:" bullet: every package of
anneal/ is named as `` `name/` ``, and every `` `name/` `` or `` `name.py` `` it names is a
package or module of anneal/ or a folder or file at the repository's root."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANNEAL = ROOT / "anneal"
PACKAGES = sorted(p.name for p in ANNEAL.iterdir() if (p / "__init__.py").is_file())
TOP_MODULES = sorted(p.name for p in ANNEAL.glob("*.py") if p.name != "__init__.py")
OPTIONAL = {"__init__", "__main__"}  # a package's dunder modules may go unnamed
BARE = re.compile(r"[a-z_][a-z0-9_]*")


def _holds() -> str:
    """docs/architecture.md from "What each part holds:" to the next section."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("What each part holds:")
    return text[start : text.index("\n## ", start)]


def _bullets(text: str) -> list[str]:
    """The markdown bullets of ``text`` (``- `` at the line's start), each with its
    continuation lines."""
    return [b.strip() for b in re.split(r"^- ", text, flags=re.M)[1:]]


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def test_every_package_bullet_names_exactly_its_modules():
    """Each package of anneal/ has its bullet, naming each of its modules and no name that is not
    one (a bare lowercase name in backticks)."""
    bullets = {}
    for bullet in _bullets(_holds()):
        if m := re.match(r"`([a-z_]+)/`", bullet):
            bullets[m.group(1)] = bullet
    assert sorted(bullets) == PACKAGES, "one bullet per package of anneal/"
    wrong = {}
    for package, bullet in bullets.items():
        modules = {p.stem for p in (ANNEAL / package).glob("*.py")}
        named = {name for name in _ticked(bullet) if BARE.fullmatch(name)}
        missing, unknown = sorted(modules - OPTIONAL - named), sorted(named - modules)
        if missing or unknown:
            wrong[package] = {"not named": missing, "not a module": unknown}
    assert wrong == {}, "docs/architecture.md, What each part holds"


def test_every_top_level_module_is_named():
    """Each module directly under anneal/ is named as ``name.py`` in the list, and every
    ``name.py`` named there exists."""
    named = {name for name in _ticked(_holds()) if re.fullmatch(r"[a-z_]+\.py", name)}
    assert sorted(named - {"__init__.py"}) == TOP_MODULES


def test_readme_layout_names_every_package_and_only_what_exists():
    """README.md's "Layout:" bullet names every package of anneal/ (``name/``), and each folder
    or module it names is in anneal/ or at the repository's root."""
    readme = (ROOT / "README.md").read_text()
    (layout,) = [b for b in _bullets(readme) if b.startswith("Layout:")]
    names = [n for n in _ticked(layout) if re.fullmatch(r"[a-z_]+(/|\.py)", n)]
    packages = {n[:-1] for n in names if n.endswith("/")}
    assert sorted(set(PACKAGES) - packages) == [], "packages of anneal/ that README's map misses"
    unknown = [n for n in names if not ((ANNEAL / n).exists() or (ROOT / n).exists())]
    assert unknown == [], "README's map names what is neither in anneal/ nor at the root"
