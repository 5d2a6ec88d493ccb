"""Control: the Coordinator's board of replica load, scaling through Serve, autoscaling, and
whether a scale target fits the cluster."""
