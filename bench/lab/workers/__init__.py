"""Processes the lab starts on its hosts; each prints ``LAB {json}`` records for the driver."""
