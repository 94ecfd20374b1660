"""tests.engine.rl"""
