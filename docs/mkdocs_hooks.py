"""MkDocs hooks for the documentation site (``mkdocs.yml``: ``hooks``).

The site is built from ``docs/``, with two files from outside it, so that each exists once and its
links work both on GitHub and on the site:

- the home page (``index.md``) is the repository's ``README.md``;
- ``bench/RESULTS.md`` is the "Benchmark results" page (``results.md``): every figure in the manual
  links to the section of RESULTS.md where it was measured (``../bench/RESULTS.md#...``).

``on_page_markdown`` rewrites each relative link to its place on the site (the README's
``docs/training.md`` -> ``training.md``, a page's ``../bench/RESULTS.md#x`` -> ``results.md#x``,
RESULTS.md's ``../docs/ROCM.md#x`` -> ``ROCM.md#x``); a link to any other file outside ``docs/`` is
left as it is, so ``mkdocs build --strict`` fails on it (name such files in code spans instead).
``on_page_content`` drops the Sphinx roles (``:func:``, ``:class:``, ...) that the package's
docstrings put before their code spans, so the API reference reads ``zaya_jax.load``, not
``:func:`zaya_jax.load```.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

README = "README.md"  # in the repository, shown as the site's index.md
RESULTS = "bench/RESULTS.md"  # in the repository, shown as the site's results.md
RESULTS_PAGE = "results.md"
_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\s+\"[^\"]*\")?\)")
_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc|const|term|ref):(?=<code)")


def _repository(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_files(files: Files, config) -> Files:
    source = _repository(config) / RESULTS
    files.append(File.generated(config, RESULTS_PAGE, abs_src_path=str(source)))
    return files


def _repository_path(src_uri: str) -> str:
    """Which file of the repository a page shows."""
    return {"index.md": README, RESULTS_PAGE: RESULTS}.get(src_uri, f"docs/{src_uri}")


def on_page_markdown(markdown: str, page, config, files) -> str:
    shown = _repository_path(page.file.src_uri)
    if shown == README:
        markdown = (_repository(config) / README).read_text()
    here = posixpath.dirname(shown)

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        in_repository = posixpath.normpath(posixpath.join(here, target))
        if in_repository == RESULTS:
            site = RESULTS_PAGE
        elif in_repository.startswith("docs/"):
            site = in_repository.removeprefix("docs/")
        else:
            return match.group(0)
        site = posixpath.relpath(site, posixpath.dirname(page.file.src_uri) or ".")
        return f"{match.group(1)}{site}{match.group(3) or ''}{match.group(4) or ''})"

    return _LINK.sub(rewrite, markdown)


def on_page_content(html: str, page, config, files) -> str:
    return _ROLE.sub("", html)
