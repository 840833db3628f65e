"""The notifier: committed transitions -> signed webhook deliveries with durable retries."""
