"""Device meshes, logical-axis rules and multi-host set-up; config.py: their config sections."""
