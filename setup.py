"""Build of the optional compiled pgoutput hot path; everything else is in pyproject.toml.

``optional=True``: where no C compiler or Python headers are found, the install still succeeds and
``sequin_provider.pgoutput`` runs its pure-Python references (``pgoutput.COMPILED`` is False).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sequin_provider._pgoutput_c", ["sequin_provider/_pgoutput_c.c"], extra_compile_args=["-O2"], optional=True
        )
    ]
)
