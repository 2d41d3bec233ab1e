"""User entry points: the `mrv2` command line."""
