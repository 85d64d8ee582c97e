"""Model runtimes: each turns a version directory into instances that execute batches."""
