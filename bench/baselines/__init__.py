"""Two Lambda-style stream handlers that maintain the commerce aggregates: naive and idempotent."""
