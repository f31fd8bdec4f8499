"""Role processes: the entry every launcher runs, and the programs roles run."""
