"""tests.schema"""
