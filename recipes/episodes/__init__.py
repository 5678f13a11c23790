"""Multi-turn episodes, black-box agents, environments and tools."""
