"""Plain data shared by every layer: requests, responses, tensors, datatypes, errors."""
