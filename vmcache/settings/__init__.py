"""What operators say, parsed and validated: host config, domain metadata, disk policy (pure)."""
