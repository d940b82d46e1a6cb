"""Sphinx configuration for the gpu_serde docs (MyST Markdown, API from docstrings)."""

project = "gpu_serde"
author = "gpu_serde developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_static_path = ["_static"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
