"""Azure Machine Learning: each environment one run."""
