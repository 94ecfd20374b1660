"""engine/rl"""
