"""Pull API integration tests: the API in-process and with real clients against `sequin api`."""
