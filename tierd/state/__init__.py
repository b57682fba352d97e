"""What the daemon knows of its clients (sessions, instances, leases, tenants) and how a
registered layout maps a request onto pool objects and copies (the planner)."""
