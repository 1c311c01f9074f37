"""Package discovery for the one import name `ppdsl` (all metadata is in pyproject.toml).

The repository keeps the top-level folders dsl/, lowering/, runtime/ and core/ beside ppdsl/;
installed, each is a sub-package of `ppdsl`. Every package below them is found here by
setuptools' own `find_packages`, so a new folder cannot be left out of the wheel (a hand-kept
list once missed core/families/own/). setuptools rather than hatchling: hatchling's `sources`
mapping maps whole trees too, but refuses editable installs when a mapping adds a prefix
(`core` -> `ppdsl/core`), and the development set-up installs editable.
"""

from setuptools import find_packages, setup

# import name -> the folder that holds it
TREES = {
    "ppdsl": "ppdsl",
    "ppdsl.core": "core",
    "ppdsl.dsl": "dsl",
    "ppdsl.lowering": "lowering",
    "ppdsl.runtime": "runtime",
}


def packages() -> list[str]:
    found = []
    for name, folder in TREES.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return found


setup(packages=packages(), package_dir=TREES)
