"""tests.engine.data"""
