"""System tests: airflow standalone, a Spark standalone cluster, chaos, the installed wheel, the PostgreSQL
version matrix, large transactions."""
