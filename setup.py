"""The packages of the distribution, found rather than listed (everything else is in pyproject.toml):
tierd/ and every package folder under it, client/ as tierd_client, native/ as tierd.native.

pyproject.toml's ``packages.find`` names a package after its folder, so it cannot install client/
as tierd_client; this file only feeds setuptools' own discovery (``find_packages``) those three
roots. tests/, benchmarks/, scripts/, deploy/ and docs/ are never searched.
"""

from setuptools import find_packages, setup

ROOTS = {"tierd": "tierd", "tierd_client": "client", "tierd.native": "native"}


def packages() -> list[str]:
    return [
        pkg
        for name, folder in ROOTS.items()
        for pkg in [name, *(f"{name}.{p}" for p in find_packages(folder))]
    ]


setup(packages=packages(), package_dir=ROOTS)
