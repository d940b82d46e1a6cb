"""Sphinx configuration for the gpu_serde docs (MyST Markdown, API from docstrings).

Build: ``pip install -e ".[docs]"`` then ``sphinx-build -W -b html docs docs/_build/html``
(docs/building-docs.md). The plots on the performance page are committed files made by
``benchmarks/plot.py``: building the docs runs no benchmark and needs no matplotlib.
"""

project = "gpu_serde"
author = "the gpu_serde developers"
copyright = "2026, the gpu_serde developers; Apache-2.0"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_static_path = ["_static"]
html_css_files = ["gpu_serde.css"]  # code blocks wrap; a page wide enough for 1280 px screens
html_title = "gpu_serde"
html_show_sourcelink = False
html_theme_options = {
    "description": "cuda.core GPU objects between Ray, Dask and multiprocessing, by GPU UUID",
    "page_width": "1180px",
    "sidebar_width": "230px",
    "show_powered_by": False,
    "github_button": False,
    "extra_nav_links": {},
}
myst_heading_anchors = 3
# A docstring's literal block (``::``) is shown as written, not highlighted as Python: most are
# tables of names in English. Python in a docstring says so (``.. code-block:: python``); the
# Markdown pages name each fence's language.
highlight_language = "none"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
