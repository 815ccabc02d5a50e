"""Small helpers with no knowledge of the components: logging, files, environment."""
