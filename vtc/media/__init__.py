"""Media input: reading videos, frame sampling conventions, processor inputs."""
