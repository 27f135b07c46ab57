"""Spark glue: the replication data source and the micro-batch pipeline. Never imports Airflow."""
