"""engine/testing"""
