"""The kopf operator. Only ever imported as `anneal.operator` (never shadows the stdlib `operator`)."""
