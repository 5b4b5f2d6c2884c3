"""The documentation site builds with ``mkdocs build --strict`` and its API pages are generated.

Needs ``mkdocs`` and ``mkdocstrings[python]`` (the ``test`` extra).
"""

import ast
import html
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
# Command-line programs, documented in README.md and docs/benchmarks.md rather than as an API.
NOT_API = ("tfnng.bench", "tfnng.demo")
DIRECTIVE = re.compile(r"^::: (tfnng(?:\.\w+)*)\s*$", re.MULTILINE)


def _build(config, site_dir):
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)


def _module_file(dotted):
    """Source file of module ``dotted`` (a module or package), or None for a non-module object."""
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _public_modules():
    """Dotted names of tfnng's public modules (not packages' __init__, not private, not NOT_API)."""
    names = set()
    for path in (ROOT / "tfnng").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if not any(part.startswith("_") for part in parts):
            names.add(".".join(parts))
    return {n for n in names if not any(n == x or n.startswith(x + ".") for x in NOT_API)}


def _plain(text):
    """Text without HTML tags or Markdown/reST code and emphasis marks, whitespace normalised."""
    text = html.unescape(re.sub(r"<[^>]+>", "", text))
    return " ".join(re.sub(r"[`*]", "", text).split())


def test_site_builds_strict_and_renders_every_api_module(tmp_path):
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr

    documented = set()
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        rendered = tmp_path / "site" / "api" / page.stem / "index.html"
        text = _plain(rendered.read_text(encoding="utf-8"))
        for dotted in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            source = _module_file(dotted)
            if source is None:                      # a function/class re-exported by tfnng
                assert dotted.rsplit(".", 1)[1] in text, (dotted, page)
                continue
            docstring = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8")))
            summary = _plain(re.sub(r":\w+:`~?", "`", docstring.splitlines()[0]))   # docs/hooks.py
            assert summary in text, (dotted, summary, page)
            documented.add(dotted)
    missing = _public_modules() - documented
    assert not missing, f"public modules without an API page under docs/api/: {sorted(missing)}"


def test_strict_build_fails_on_a_nav_entry_to_a_missing_page(tmp_path):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    # the copy lives in tmp_path: make the config's relative paths absolute
    config["docs_dir"] = str(ROOT / "docs")
    config["hooks"] = [str(ROOT / hook) for hook in config.get("hooks", [])]
    config["nav"] = config["nav"] + [{"Missing": "no_such_page.md"}]
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    broken = tmp_path / "mkdocs.yml"
    broken.write_text(yaml.safe_dump(config), encoding="utf-8")

    result = _build(broken, tmp_path / "site")
    assert result.returncode != 0
    assert "no_such_page.md" in result.stdout + result.stderr


def test_ci_runs_exactly_the_readme_test_command():
    """`.ci/run` must run the command README.md gives for the tests, character for character."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("Running the tests", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", section, re.DOTALL).group(1).strip()
    ci_commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci_commands == [command]
