"""Process harness for coordination-guard tests: real redis-server, webdis, Envoy, upstream."""
