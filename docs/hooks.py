"""MkDocs hooks: serve the guides that live beside the code as pages of the site.

The operator's, the chart's and the benchmarks' READMEs stay next to what they describe
(where a contributor edits them with the code); the site shows them under its own paths
(`MIRRORS`), with the result plots they embed. Their relative links are rewritten: to the
site page when the target is mirrored, to the path in code font when it is a repository
file the site does not carry, and left alone otherwise, so that `mkdocs build --strict`
fails on a link to a file that does not exist.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent

# repository path -> site path
MIRRORS = {
    "operator/README.md": "kubernetes/operator.md",
    "charts/pagedllm/README.md": "kubernetes/chart.md",
    "benchmarks/README.md": "performance/benchmarks.md",
    "benchmarks/results/README.md": "performance/results.md",
    "benchmarks/results/gpu/README.md": "performance/gpu.md",
    "benchmarks/results/real-models-2026-11-27.md": "performance/real-models.md",
    "benchmarks/results/quantized-2026-11-27.md": "performance/quantized.md",
}
PLOTS = "benchmarks/results/paper"
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _site_assets() -> dict[str, str]:
    """Every mirrored file, the plots included: repository path -> site path."""
    assets = dict(MIRRORS)
    for png in sorted((ROOT / PLOTS).glob("*.png")):
        repo_path = png.relative_to(ROOT).as_posix()
        assets[repo_path] = "performance/" + repo_path.removeprefix("benchmarks/")
    return assets


def on_files(files: Files, config) -> Files:
    for repo_path, site_path in _site_assets().items():
        files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
    return files


def _repo_path_of(page_src_uri: str) -> str:
    for repo_path, site_path in MIRRORS.items():
        if site_path == page_src_uri:
            return repo_path
    return "docs/" + page_src_uri


def _rewrite(match: re.Match, source_dir: str, page_dir: str, assets: dict[str, str]) -> str:
    bang, text, target = match.groups()
    if "://" in target or target.startswith(("#", "mailto:")):
        return match.group(0)
    path, _, anchor = target.partition("#")
    repo_target = posixpath.normpath(posixpath.join(source_dir, path))
    if repo_target in assets:
        new = posixpath.relpath(assets[repo_target], page_dir or ".")
        return f"{bang}[{text}]({new}{'#' + anchor if anchor else ''})"
    if repo_target.startswith("docs/"):
        return match.group(0)  # a page of the site: MkDocs checks it
    if (ROOT / repo_target).exists():
        return f"{text} (`{repo_target}`)" if text and text != repo_target else f"`{repo_target}`"
    return match.group(0)  # missing: left for --strict to report


def on_page_markdown(markdown: str, page, config, files) -> str:
    repo_path = _repo_path_of(page.file.src_uri)
    source_dir = posixpath.dirname(repo_path)
    page_dir = posixpath.dirname(page.file.src_uri)
    assets = _site_assets()
    return _LINK.sub(lambda m: _rewrite(m, source_dir, page_dir, assets), markdown)
