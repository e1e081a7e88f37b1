"""The one thing pyproject.toml cannot say on every setuptools: the optional C core of
dedup's searches.  ``optional=True``: without a compiler the package installs anyway and
dedup runs its pure-Python passes (``promptsplice.dedup.ACCELERATED`` is then False)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "promptsplice.dedup._speedups",
            sources=["dedup/_speedups.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
