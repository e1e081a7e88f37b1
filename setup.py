"""The one thing pyproject.toml cannot say on every setuptools: the optional C core of
dedup's searches.  Optional for users: without a compiler the package installs anyway
and dedup runs its pure-Python passes (``promptsplice.dedup.ACCELERATED`` is then
False).  ``PROMPTSPLICE_REQUIRE_C_CORE=1`` (what ``scripts/setup.sh`` sets) makes a
failed build an error instead, so a checkout never runs an old or missing core."""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "promptsplice.dedup._speedups",
            sources=["dedup/_speedups.c"],
            extra_compile_args=["-O2"],
            optional=os.environ.get("PROMPTSPLICE_REQUIRE_C_CORE") != "1",
        )
    ]
)
