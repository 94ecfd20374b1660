"""tests.stages"""
