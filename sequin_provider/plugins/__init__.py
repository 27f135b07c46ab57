"""Airflow plugins of the Sequin provider."""
