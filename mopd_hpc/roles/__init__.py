"""One entry point per child role a guard starts (`runtime/guard/roles.py` maps role → module): `actor`,
`teacher`, `rollout`, `probe`. Each reads its environment once (`env.RoleEnv`), builds what it runs from the
run's config, and runs it; `endpoints` waits for the servers' endpoint records."""
