"""Development tooling of a source checkout, not shipped in the wheel: the demo (``python -m
devtools.demo``), ``make up`` (``devtools.up``), the embedded-Postgres harness of the tests and
benchmarks (``embedded_postgres``, ``postgres_binaries``), the Spark apps as watched child processes
(``stream_process``) and the ``airflow standalone`` client (``airflow_standalone``)."""
