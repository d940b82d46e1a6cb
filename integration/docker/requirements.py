"""Print what installing a pyproject.toml's project with the given extras needs, one a line, for
``pip install``: its build requirements, its dependencies and the extras' (self-references such as
``gpu-serde[ray,dask]`` expanded).

Usage: ``python requirements.py pyproject.toml EXTRA...``; the Dockerfile installs them in a
layer of their own, so that a change to the sources does not download them again.
"""

from __future__ import annotations

import re
import sys

import tomllib


def requirements(path: str, extras: list[str]) -> list[str]:
    """The build requirements and dependencies of the project, and those of ``extras``."""
    with open(path, "rb") as f:
        config = tomllib.load(f)
    project = config["project"]
    name = re.sub(r"[-_.]+", "-", project["name"]).lower()
    optional = project.get("optional-dependencies", {})
    seen: set[str] = set()
    out = [*config.get("build-system", {}).get("requires", []), *project.get("dependencies", [])]
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional.get(extra, []):
            own = re.fullmatch(
                rf"{re.escape(name)}\[([^\]]*)\]", re.sub(r"[-_.]+", "-", req).lower()
            )
            if own:
                todo += [e.strip() for e in own.group(1).split(",")]
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
