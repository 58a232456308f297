"""titanium: a PyTorch-native library for training large language models."""
