"""Hugging Face causal-LM integration: models, calibration data, evaluation and layer capture."""
