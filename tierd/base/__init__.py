"""What every layer reads: the settings, the counters, the second tier's URL grammar."""
