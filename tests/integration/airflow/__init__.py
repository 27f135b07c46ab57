"""Airflow integration tests: operators, hooks, sensors, triggers, notifications, plugin, DAGs."""
