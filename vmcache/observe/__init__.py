"""What operators see, never what is pinned: metrics, their exporter and file_sd, heat maps, status files."""
