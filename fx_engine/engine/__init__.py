"""The imperative shell: owns resources and row membership; calls the pure steps."""
