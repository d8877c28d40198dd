"""An example of a team's own package: a model factory and dataset factories that traincore trains."""
