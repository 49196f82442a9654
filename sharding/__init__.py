"""Device meshes, logical-axis rules and multi-host set-up."""
