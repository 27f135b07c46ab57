"""Build of the optional compiled hot paths; everything else is in pyproject.toml.

``optional=True``: where no C compiler or Python headers are found, the install still succeeds and
``sequin_provider.pgoutput`` and ``sequin_provider.ack_ids`` run their pure-Python references
(``pgoutput.COMPILED`` and ``ack_ids.COMPILED`` are False).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sequin_provider._pgoutput_c", ["sequin_provider/_pgoutput_c.c"], extra_compile_args=["-O2"], optional=True
        ),
        Extension(
            "sequin_provider._ack_ids_c", ["sequin_provider/_ack_ids_c.c"], extra_compile_args=["-O2"], optional=True
        ),
    ]
)
