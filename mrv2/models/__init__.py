"""Model definitions (`decoder`), the architecture registry (`registry`) and their names (`architectures`)."""
