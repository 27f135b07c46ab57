-- Airflow's metadata database, next to the captured "shop" database (docker-compose.yaml).
CREATE DATABASE airflow;
