"""tests.engine.models"""
