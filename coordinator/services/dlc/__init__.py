"""Alibaba Cloud PAI-DLC: each environment one job."""
